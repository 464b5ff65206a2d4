"""qkv in the browser: the static site and its in-page model engine."""
