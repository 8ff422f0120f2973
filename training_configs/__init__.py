"""slime launch configurations (YAML), their schema, validator and renderer."""
