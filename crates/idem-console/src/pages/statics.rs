//! The console's static files, embedded in the binary and served with their
//! content types and a long cache (their URLs carry
//! [`crate::html::ASSET_VERSION`]).

use axum::http::header;
use axum::response::IntoResponse;

/// The stylesheet: the pages' rules, then the timeline picture's.
pub const CSS: &str = concat!(
    include_str!("../../static/console.css"),
    include_str!("../../static/timeline.css")
);
/// The script (live updates of the task page).
pub const JS: &str = include_str!("../../static/console.js");

/// The cache policy of the static files: a year, never revalidated.
const LONG_CACHE: &str = "public, max-age=31536000, immutable";

/// `GET /console/static/console.css`.
pub async fn css() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, LONG_CACHE),
        ],
        CSS,
    )
}

/// `GET /console/static/console.js`.
pub async fn js() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, LONG_CACHE),
        ],
        JS,
    )
}
