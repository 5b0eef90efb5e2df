"""Shared building blocks. A family file composes these; it does not copy them."""
