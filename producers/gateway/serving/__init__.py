"""What serving at load needs: the HTTP server's bounds (:mod:`.server`), Redis
connections that recover by themselves (:mod:`.connections`), one events reader for every
job in flight (:mod:`.hub`), and the health and metrics endpoints."""
