"""The preview of a session's servers: an HTTP proxy into the session's network
namespace, the injected error reporter, a WebSocket tunnel and a WebSocket relay."""
