"""The HTTP API's types: what the service, the SDK, the node agent and the gateway send and receive."""
