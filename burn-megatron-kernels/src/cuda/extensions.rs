//! Per-device state of foreign libraries (a cuBLASLt handle, NCCL communicators, the profile's
//! recorder): one value per type, kept by the device's server and handed to foreign operations.

use std::any::{Any, TypeId};
use std::collections::HashMap;

/// Per-device state, one value per type.
#[derive(Default)]
pub struct Extensions {
    values: HashMap<TypeId, Box<dyn Any + Send>>,
}

impl Extensions {
    /// The value of type `T`, created by `init` on first use.
    pub fn get_or_insert_with<T: Any + Send>(&mut self, init: impl FnOnce() -> T) -> &mut T {
        self.values
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(init()))
            .downcast_mut()
            .expect("values are stored under their own type id")
    }

    /// The value of type `T`, if there is one.
    pub fn get_mut<T: Any + Send>(&mut self) -> Option<&mut T> {
        self.values
            .get_mut(&TypeId::of::<T>())
            .and_then(|v| v.downcast_mut())
    }
}
