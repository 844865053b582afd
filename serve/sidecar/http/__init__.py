"""The sidecar's HTTP edge: the app factory, the routes, the write token, the request
counting middleware, the one mapping from :mod:`serve.errors` to HTTP codes, the docs and
the request/response bodies. Routes parse and answer; what they change goes through
:mod:`serve.sidecar.control` or a service. Imports control, services and adapters; nothing
imports it back."""
