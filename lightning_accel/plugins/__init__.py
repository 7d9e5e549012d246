"""Lightning plugins: precision plugins and checkpoint IO."""
