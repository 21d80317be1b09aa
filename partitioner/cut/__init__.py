"""Graph surgery: which nodes run on the host, the host/dense split, pipeline stages."""
