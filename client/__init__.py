"""The gradps CLI and Python SDK."""
