"""What the bytes look like: DCP file names and keys, safe unpickling, the .metadata template, torch.save records."""
