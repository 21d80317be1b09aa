"""From what a user brings (a zoo name, a torch.export program, an ONNX file) to a graph to cut."""
