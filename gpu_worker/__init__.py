"""Worker side: the training loop as a library (Trainer) and the worker service around it."""
