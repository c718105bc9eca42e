"""The chat's modal screens."""
