"""The `localspec chat` terminal UI (Textual)."""
