"""The host (sparse) stage: table-batched embedding bags, tiered table stores, row updates, host calibration."""
