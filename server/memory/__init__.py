"""The serving process's own memory: freed memory kept for reuse, short garbage-collector pauses."""
