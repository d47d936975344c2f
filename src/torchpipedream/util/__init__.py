"""Small shared helpers with no torch: JSON files whose errors name file and line, byte and bandwidth units."""
