"""Security: client API keys, tenants and their limits, and the admin token."""
