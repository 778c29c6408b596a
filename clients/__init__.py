"""StateBudget clients: the SDK (`clients.sdk`) and the node agent (`clients.agent`)."""
