"""Which device runs what: placement strategies and embedding-table shards on cards."""
