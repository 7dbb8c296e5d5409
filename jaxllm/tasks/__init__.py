"""Course tasks built on the library: associative recall by hand and the layer sweep."""
