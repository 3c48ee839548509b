"""What the bytes look like: DCP file names and keys, safe unpickling, the .metadata template, the zip layout of
torch.save archives (``torch_zip``) and the records framed and decoded with it, the checksum sidecar."""
