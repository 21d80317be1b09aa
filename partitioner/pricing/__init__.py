"""What a plan costs: FLOPs and bytes per partition, the plan's estimates, table tiers, measured checks."""
