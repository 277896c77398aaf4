//! The server end to end: started on 127.0.0.1 port 0, driven by a real HTTP client.

mod common;

mod api;
mod concurrency;
mod families;
mod lifecycle;
