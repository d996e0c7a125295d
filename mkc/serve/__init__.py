"""`mkc serve`: an OpenAI-compatible server over a generated module, with continuous batching
of requests into the kernel's rows (engine), on-device sampling (sampling), the HTTP API
(api), loading what is served (model), and starting it in a child process (launch)."""
