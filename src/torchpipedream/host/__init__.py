"""Allocator settings for processes torchpipedream owns (huge pages, freed memory), never the caller's."""
