"""The live gateway: the admission layer's `Gateway`, policies and estimator as an HTTP server in front of
vLLM replicas (`simadmit gateway`)."""
