"""Decoder models and their weight loading."""
