"""One server as N front-end processes on one port over one engine: the supervisor, the channel, one metrics page."""
