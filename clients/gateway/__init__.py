"""The gateway: an OpenAI-compatible front door that routes each request by the planner's route table."""
