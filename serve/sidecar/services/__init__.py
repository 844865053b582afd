"""The sidecar's services: embedding deltas (:mod:`~serve.sidecar.services.deltas`:
``POST /embeddings/deltas``, checked and published to the workers) and click feedback
(``POST /feedback`` joined with the prediction log). Each is called by the HTTP edge and
reads the controllers' snapshot."""
