"""Static assets of `agentree view` (template, script, style), inlined into each page."""
