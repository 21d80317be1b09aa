"""Running one batch through a plan: the host stage, then the dense stage on the cards, with card health."""
