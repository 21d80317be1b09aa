"""One server as N processes on one port: the supervisor, the siblings, one metrics page."""
