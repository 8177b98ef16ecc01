"""Graph passes of the comera backend, one per file."""
