"""One-off investigations (see README.md here): each answered one question once. The
benchmark harness in ``bench`` imports nothing from this package."""
