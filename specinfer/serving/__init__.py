"""Service plumbing shared by the gateway, verifier and speculator (no model code here)."""
