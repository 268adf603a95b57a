"""rwinterp."""
