"""Turn-level controllers (multi-turn envs, forking by snapshot/restore): `turns` (the turn
runner they share), `flat` (GRPO), `patr` (PATR, Tree-Random), `arpo`, `treegrpo`, `tsr`."""
