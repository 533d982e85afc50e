"""Token-level controllers (one-step envs, branching inside one answer): `tokentree` (the
shared token tree), `latr`, `treepo`, `eptree`."""
