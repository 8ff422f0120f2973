"""Features: opt-in behaviour the plugin adds to SGLang (not fixes), pinned and reported like the fixes."""
