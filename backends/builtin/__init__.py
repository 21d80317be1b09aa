"""The built-in card backends: ONNX Runtime, torch, simcard (a simulated card) and tables on simcards."""
