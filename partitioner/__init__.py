"""partitioner package."""
