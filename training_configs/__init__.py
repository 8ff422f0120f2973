"""slime launch configurations (YAML), their schema, validator and renderer.

- `schema`: the typed schema and `load_config(path)` (one-line `ConfigError`s naming the field).
- `derive`: attn_tp_size and the DP-attention gathers, from the installed SGLang or our copy of its rules.
- `check`: `config check` (structure, EAGLE, SGLang's own validation, stated-vs-derived, fixes needed).
- `render`: `config render` (SGLang flags, slime flags, managed-engine addresses).
- `cli`: the `config` sub-command of `slime-moe-rollout`.
"""
