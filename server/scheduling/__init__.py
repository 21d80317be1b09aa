"""Which requests run together, and when and where: admission, the dynamic batcher, the card gate, the router."""
