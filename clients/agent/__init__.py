"""The StateBudget node agent: registers, heartbeats, leases operations and carries them out."""
