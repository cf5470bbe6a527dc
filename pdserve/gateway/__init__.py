"""OpenAI-compatible REST gateway: `gateway.app.create_app(backend, GatewayConfig(...))`."""
