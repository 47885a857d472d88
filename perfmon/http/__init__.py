"""perfmon's HTTP layer: /metrics /healthz /stats /profile /profiles, on the agent's port or mounted.

    agent         the Agent protocol: all this layer knows of the monitor
    wire          the request parser, response encoding, socket helpers, content negotiation, shared renders
    security      loopback, Host and Origin checks, the token, AuthThrottle
    routes        Router: a request to a Response
    openapi       /openapi.json
    apps          make_wsgi_app, make_asgi_app
    agent_server  AgentServer: the agent's port, one selector thread within a CPU budget
    exchange      HTTP/1.1 on that server's connections
    connections   the connections it holds, their selectors, eviction and deadlines
    health_port   HealthServer: /healthz alone on a port of its own
    ports         binding both servers, retrying in the background
"""
