//! API keys: create, revoke, list, authenticate (SPEC §4 Auth).

use idem_core::model::{ApiKey, Role, Serves};
use uuid::Uuid;

use super::Operation;
use crate::{Result, Tx, generate_api_key, hash_api_key};

/// Create an API key; replies with the stored record and the plain key
/// (shown once, never stored).
#[derive(Debug, Clone)]
pub struct CreateApiKey {
    /// Tenant.
    pub tenant: String,
    /// Role.
    pub role: Role,
    /// Operation limit (`None` = all classes).
    pub operations: Option<Vec<String>>,
    /// The tenants a pool executor key serves (`None`: its own; SPEC §2.13).
    pub serves: Option<Serves>,
}

impl Operation for CreateApiKey {
    type Reply = (ApiKey, String);
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<(ApiKey, String)> {
        let now = tx.now().await?;
        let plain = generate_api_key();
        let key = ApiKey {
            id: tx.new_id(),
            tenant: self.tenant.clone(),
            role: self.role,
            operations: self.operations.clone(),
            serves: self.serves.clone(),
            created_at: now,
            revoked_at: None,
        };
        tx.insert_api_key(&key, &hash_api_key(&plain)).await?;
        Ok((key, plain))
    }
}

/// Revoke an API key; replies with the key (`None`: no such key).
#[derive(Debug, Clone)]
pub struct RevokeApiKey {
    /// Key id.
    pub id: Uuid,
}

impl Operation for RevokeApiKey {
    type Reply = Option<ApiKey>;
    const WRITES: bool = true;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Option<ApiKey>> {
        let now = tx.now().await?;
        tx.revoke_api_key(self.id, now).await
    }
}

/// List every API key, oldest first.
#[derive(Debug, Clone)]
pub struct ListApiKeys;

impl Operation for ListApiKeys {
    type Reply = Vec<ApiKey>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Vec<ApiKey>> {
        tx.list_api_keys().await
    }
}

/// Find the active or revoked key a bearer token names.
#[derive(Debug, Clone)]
pub struct Authenticate {
    /// The bearer token.
    pub plain: String,
}

impl Operation for Authenticate {
    type Reply = Option<ApiKey>;
    const WRITES: bool = false;
    async fn run<T: Tx>(&self, tx: &mut T) -> Result<Option<ApiKey>> {
        tx.api_key_by_hash(&hash_api_key(&self.plain)).await
    }
}
