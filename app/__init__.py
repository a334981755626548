"""servax's Ray Serve application.

    config.py    the YAML/args schema (LLMConfig-shaped model blocks, ingress block)
    builder.py   build_app(args): one LLMServer per model + the OpenAI ingress
    server.py    LLMServer: the deployment owning one AsyncLLMEngine (handle API: generate, stream)
    serving.py   the OpenAI protocol on top of an engine (runs inside LLMServer)
    protocol.py  OpenAI request/response bodies
    ingress.py   the FastAPI app and its Serve deployment (routing by `model`, errors, SSE)
    metrics.py   Serve metrics of a replica
"""
