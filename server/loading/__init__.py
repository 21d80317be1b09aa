"""From a model name or a model repository to served models: loading, config.pbtxt, explicit model control."""
