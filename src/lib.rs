//! The benchmark's side of the repository: the registry of every method (see [`methods`]).
pub mod methods;
