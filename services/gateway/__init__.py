"""The public gateway service: sessions, validation, streaming and resumable request state.

Entry point: `python -m services.gateway` (services/gateway/server.py `main`).
"""
