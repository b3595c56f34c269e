"""gpurl.train."""
